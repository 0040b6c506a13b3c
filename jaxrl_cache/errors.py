"""Typed errors. Each names what was asked and what the state was."""


class VersionError(ValueError):
    """A policy version went backwards, or is not a non-negative integer."""


class StalenessError(RuntimeError):
    """A batch's behavior version lags the trainer by more than max_policy_lag."""


class CacheFullError(RuntimeError):
    """The KV page pool cannot hold a request, even after evicting every unpinned cached page."""


class PinnedPagesError(RuntimeError):
    """Invalidation refused: live requests still hold pages of the versions to drop."""


class AuditError(RuntimeError):
    """The attribution audit flagged samples (rl/audit.py `refuse`): their recorded log-probs
    are not the ones the params of their version give; the message names them. Nothing was
    trained on them."""


class RewardError(ValueError):
    """A reward function raised, timed out, or gave a wrong count or a non-finite value
    (rl/rewards.py); one line naming the step, the function and the sample. Nothing was
    trained."""
