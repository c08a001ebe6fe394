"""Exceptions with messages a user can act on."""


class AfdServeError(Exception):
    """Base class of afdserve's errors."""


class ModelError(AfdServeError):
    """A model folder, config or checkpoint cannot be used."""


class ConfigError(AfdServeError, ValueError):
    """An engine or deployment option is invalid; the message names the field."""


class RequestError(AfdServeError, ValueError):
    """A request cannot be served (empty prompt, too long, bad sampling params...)."""


class WorkerError(AfdServeError):
    """A worker of the deployment failed; the message names the worker."""
