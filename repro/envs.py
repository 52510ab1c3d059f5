"""Bad-input environments for the audit (TRL environment_factory shape)."""
import math
from rlalign.tasks import lookup as L


class Good:
    def reset(self, **row):
        self.n = 0

    def lookup(self, name: str) -> str:
        """Look up an item.

        Args:
            name: The item's name.
        """
        self.n += 1
        return L.lookup(name)

    def get_reward(self) -> float:
        return float(self.n)


class InitRaises(Good):
    def __init__(self):
        raise RuntimeError("db connection refused")


class ResetRaises(Good):
    def reset(self, **row):
        raise KeyError("answer")


class ResetNumber(Good):
    def reset(self, **row):
        self.n = 0
        return 42


class ResetDict(Good):
    def reset(self, **row):
        self.n = 0
        return {"role": "user", "content": "hi"}


class NoHints(Good):
    def search(self, q):
        """Search.

        Args:
            q: query.
        """
        return q


class NoDoc(Good):
    def search(self, q: str) -> str:
        return q


class RewardStr(Good):
    def get_reward(self):
        return "1.0"


class RewardNaN(Good):
    def get_reward(self):
        return math.nan


class RewardList(Good):
    def get_reward(self):
        return [1.0]


class MethodRaises(Good):
    def lookup(self, name: str) -> str:
        """Look up an item.

        Args:
            name: The item's name.
        """
        raise RuntimeError("boom")


class ToolsAndReward(Good):
    tools = ["lookup"]


class AsyncReset(Good):
    async def reset(self, **row):
        self.n = 0


DICT = {"good": Good, "other": Good}


def lam_tool():
    return [lambda x: x]


class ResetRaisesStep2(Good):
    calls = 0

    def reset(self, **row):
        ResetRaisesStep2.calls += 1
        if ResetRaisesStep2.calls > 4:
            raise KeyError("answer")
        self.n = 0
