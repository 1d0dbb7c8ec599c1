"""Errors that carry a message for a person, not a traceback.

The CLI prints `UserError`s as one line and exits with their code; anything else is a bug.
"""


class UserError(Exception):
    """Bad input or configuration: the message names the record and the field."""

    exit_code = 2


class GateFailed(UserError):
    """A validation gate failed: data is consistent enough to report, not to train on."""

    exit_code = 1


class Retryable(UserError):
    """A stage stopped for a reason a later attempt may not meet: the DAG lets Airflow retry it
    (with backoff); the CLI prints the message in one line. What is done is kept either way."""


class ServiceUnavailable(Retryable):
    """A service a stage needs (S3, an inference endpoint) did not answer: the message names it and
    what was tried."""


class StageStopped(Retryable):
    """A generation stage stopped before every sample was settled (retryable failures, every
    endpoint down): its committed rows are kept and the next attempt resumes after them."""

    exit_code = 3


class EndpointUnavailable(ServiceUnavailable):
    """No inference endpoint (SGLang, vLLM, OpenRouter) accepted a connection or became ready."""


class StageConflict(UserError):
    """A stage of this run key is committed (or half-written) from other inputs, params or
    tokenizer than this run's: refused before anything is written, naming what differs and the
    named way out (`--fresh`, the DAG's `fresh_stages`), since a committed stage is never replaced
    silently."""
