"""Errors that carry a message for a person, not a traceback.

The CLI prints `UserError`s as one line and exits with their code; anything else is a bug.
"""


class UserError(Exception):
    """Bad input or configuration: the message names the record and the field."""

    exit_code = 2


class GateFailed(UserError):
    """A validation gate failed: data is consistent enough to report, not to train on."""

    exit_code = 1


class ServiceUnavailable(UserError):
    """A service a stage needs (S3, an inference endpoint) did not answer: the message names it and
    what was tried. Worth retrying later: the DAG lets Airflow retry it (with backoff), the CLI
    prints it in one line."""


class EndpointUnavailable(ServiceUnavailable):
    """No inference endpoint (SGLang, vLLM, OpenRouter) accepted a connection or became ready."""
