DROP TABLE dibs_schedules;
