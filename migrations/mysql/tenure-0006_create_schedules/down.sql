DROP TABLE IF EXISTS tenure_schedules;
