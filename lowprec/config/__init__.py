"""Config: `LowprecConfig`, one frozen dataclass per section, parsed once by
`lowprec.base.parse`; `ConfigRole` says what a file must and may hold (a run, a
framework integration, a session).

May import: lowprec.tracking, lowprec.state, lowprec.policy, lowprec.sites, lowprec.numerics,
lowprec.base (the sections' own types live with what they configure).
"""

from lowprec.base.parse import ConfigError
from lowprec.config.schema import *  # noqa: F401,F403
from lowprec.config.schema import ConfigRole, LowprecConfig, ParallelConfig

__all__ = ["ConfigError", "ConfigRole", "LowprecConfig", "ParallelConfig"]
