DROP TABLE dibs_dependency_stripes;
