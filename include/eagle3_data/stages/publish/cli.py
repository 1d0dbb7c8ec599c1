"""`eagle3-data publish`: the DAG's last task for a run made with the CLI.

The run report (`report/run/run_report.json`, what `eagle3-data report` and the Airflow tab
read) and the run summary are written by the DAG's publish only; a run made stage by stage with
the CLI has neither until this command runs the same `pipeline.publish` over the datasets the run
key validated. As in the DAG, the report is written whatever happened upstream, then a run with
something missing for training (a failed gate, no merge, no hidden states) exits 1 naming it.
"""

from __future__ import annotations

import argparse
import dataclasses

from eagle3_data.cli.runs import add_config_arg, add_store_args, cli_run, printed


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("publish", help="write a CLI run's report and summary (the DAG's publish task)")
    p.add_argument("--run-key", required=True, help="the run key the stage commands used")
    p.add_argument("--bucket", help="S3 bucket (default: the config's storage.bucket)")
    p.add_argument("--prefix", help="S3 key prefix (default: the config's storage.prefix)")
    p.add_argument(
        "--skip-hidden-states",
        action="store_true",
        help="the run stops at merge: missing hidden states are not a problem (the DAG's param)",
    )
    add_config_arg(p)
    add_store_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from eagle3_data import pipeline
    from eagle3_data.stages import VALIDATE

    _, store = cli_run(args, args.run_key, [], bucket=args.bucket, prefix=args.prefix)
    validated = store.datasets(args.run_key, VALIDATE)  # a dataset the config lacks is added as the stages added it
    run, store = cli_run(args, args.run_key, validated, bucket=args.bucket, prefix=args.prefix)
    run = dataclasses.replace(run, skip_hidden_states=args.skip_hidden_states)
    print(printed(pipeline.publish(run, store)))
    return 0
