"""Exceptions with messages that name the fix, and the small validators that raise them."""

import math

# A value of the user's data quoted in an error message: for its owner to find, not for release.
OWNER = " (a value of your data: not differentially private: for the data owner only)"
OWNER_ERROR = " (raised on your data: not differentially private: for the data owner only)"  # your code's error


class DPTuneError(Exception):
    """Base class of every error dptune raises on purpose."""


class ConfigError(DPTuneError, ValueError):
    """Bad input: the message names the offending value and how to fix it."""


def config_error(path: str, problem: str, fix: str) -> ConfigError:
    """A configuration error in its usual form: ``<field>: <what is wrong>. Fix: <what to do>``."""
    return ConfigError(f"{path}: {problem.rstrip('.')}. Fix: {fix}")  # a problem's own "." was doubled (an audit)


class BudgetExceededError(DPTuneError):
    """A release was attempted that is not in the run's or study's privacy plan."""


class DivergedError(DPTuneError):
    """Training produced a non-finite loss or parameter."""


class DataError(DPTuneError):
    """A dataset is missing, corrupted or unreachable."""


def check_positive(name: str, value: float) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def check_unit_interval(name: str, value: float, closed_left: bool = True) -> float:
    ok = (0 <= value < 1) if closed_left else (0 < value < 1)
    if not ok:
        raise ConfigError(f"{name} must lie in {'[' if closed_left else '('}0, 1), got {value!r}.")
    return float(value)
