DROP TABLE IF EXISTS dibs_leases;
