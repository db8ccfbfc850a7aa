DROP TABLE tenure_schedules;
