DROP TABLE dibs_queue_limits;
