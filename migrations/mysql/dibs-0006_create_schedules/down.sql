DROP TABLE IF EXISTS dibs_schedules;
