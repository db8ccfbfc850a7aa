ALTER TABLE tenure_workflows ALTER COLUMN id DROP IDENTITY;
CREATE SEQUENCE tenure_workflows_id_seq OWNED BY tenure_workflows.id;
SELECT setval('tenure_workflows_id_seq', COALESCE((SELECT MAX(id) FROM tenure_workflows), 0) + 1, false);
ALTER TABLE tenure_workflows ALTER COLUMN id SET DEFAULT nextval('tenure_workflows_id_seq');
