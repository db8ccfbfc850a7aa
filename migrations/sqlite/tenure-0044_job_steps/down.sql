DROP TABLE tenure_steps;
