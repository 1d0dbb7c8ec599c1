"""eagle3-datagen: training data for EAGLE-3 drafters of a large target model.

The library knows nothing of Airflow: every stage is a plain function, reachable from tests,
from the CLI (`eagle3-data`) and from the thin DAG in `dags/`.
"""

__version__ = "0.1.0"
