DROP TABLE dibs_workflows;
