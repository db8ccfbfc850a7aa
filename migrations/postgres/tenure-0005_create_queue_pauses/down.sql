DROP TABLE tenure_queue_pauses;
