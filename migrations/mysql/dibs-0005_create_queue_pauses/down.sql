DROP TABLE IF EXISTS dibs_queue_pauses;
