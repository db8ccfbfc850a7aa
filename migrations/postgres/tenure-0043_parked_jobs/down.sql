DROP TABLE tenure_parked;
