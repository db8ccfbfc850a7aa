DROP TABLE tenure_dependency_stripes;
