DROP TABLE IF EXISTS tenure_leases;
