"""Exceptions with messages that name the fix."""


class DPTuneError(Exception):
    """Base class of every error dptune raises on purpose."""


class ConfigError(DPTuneError, ValueError):
    """Bad input: the message names the offending value and how to fix it."""


def config_error(path: str, problem: str, fix: str) -> ConfigError:
    """A configuration error in its usual form: ``<field>: <what is wrong>. Fix: <what to do>``."""
    return ConfigError(f"{path}: {problem}. Fix: {fix}")


class BudgetExceededError(DPTuneError):
    """A release was attempted that is not in the run's or study's privacy plan."""


class DivergedError(DPTuneError):
    """Training produced a non-finite loss or parameter."""


class DataError(DPTuneError):
    """A dataset is missing, corrupted or unreachable."""
