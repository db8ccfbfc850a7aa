DROP TABLE dibs_leases;
