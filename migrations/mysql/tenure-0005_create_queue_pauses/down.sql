DROP TABLE IF EXISTS tenure_queue_pauses;
