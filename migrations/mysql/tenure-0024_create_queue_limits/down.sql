DROP TABLE tenure_queue_limits;
