#!/usr/bin/env bash
# One-shot cluster setup, run by the airflow-init service through the image's /entrypoint (which
# has already migrated the DB and created the admin user). Idempotent: it runs on every `up`.
set -euo pipefail

# Overflow generation tasks share this pool (dags/eagle3_datagen.py: pool=OPENROUTER_POOL).
airflow pools set openrouter "${OPENROUTER_POOL_SLOTS:-256}" "OpenRouter overflow generation (eagle3-datagen)"

# The pipeline's bucket, named by the pipeline config, through the aws_default connection: the one
# deliberate bucket-creation step (`eagle3-data s3 init` outside Airflow); tasks never create it.
python - <<'PY'
from airflow.providers.amazon.aws.hooks.s3 import S3Hook

from eagle3_airflow import AWS_CONN_ID  # plugins/, on sys.path once airflow is imported

from eagle3_data.config import load_config
from eagle3_data.storage import ArtifactStore

storage = load_config().storage
ArtifactStore(S3Hook(aws_conn_id=AWS_CONN_ID).get_conn(), storage.bucket, storage.prefix).init_bucket()
print(f"bucket {storage.bucket} ready")
PY
