DROP TABLE tenure_leases;
