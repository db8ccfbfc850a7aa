DROP TABLE tenure_workflows;
