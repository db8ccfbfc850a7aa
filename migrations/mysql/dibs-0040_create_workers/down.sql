DROP TABLE dibs_workers;
