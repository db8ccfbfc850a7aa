ALTER TABLE dibs_workflows ALTER COLUMN id DROP IDENTITY;
CREATE SEQUENCE dibs_workflows_id_seq OWNED BY dibs_workflows.id;
SELECT setval('dibs_workflows_id_seq', COALESCE((SELECT MAX(id) FROM dibs_workflows), 0) + 1, false);
ALTER TABLE dibs_workflows ALTER COLUMN id SET DEFAULT nextval('dibs_workflows_id_seq');
