DROP TABLE dibs_queue_pauses;
