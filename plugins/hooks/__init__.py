"""Airflow hooks for the pipeline's connections: Airflow-side parsing of connection fields, so
the library (`eagle3_data`) receives plain values (endpoint URLs, a base URL and a key).

The plugins folder is on the workers' `sys.path`, so tasks import `hooks.local_engine` and
`hooks.openrouter`. Airflow 3.3 registers connection *types* (the form's dropdown, custom fields)
from provider packages only; until these hooks ship in one, the connections are created with
conn_type `http` (or from AIRFLOW_CONN_* URIs/JSON) and these classes read them. Each hook still
declares its UI field behaviour and extra fields in the provider format, ready for a provider's
`connection-types` entry.
"""
