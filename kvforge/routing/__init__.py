"""kvforge.routing: which server a request goes to (pure Python; consumes KV-cache block events as data).

The routers (ConversationRouter and the baselines) are thread-safe; LoadLedger, BlockTrie and ServerPrefixIndex
are building blocks without locks.
"""

from kvforge.routing.load import LoadLedger, RequestInFlightError, Reservation
from kvforge.routing.policies import CacheAwareRouter, LeastLoadRouter, RoundRobinRouter, Router
from kvforge.routing.request import BlockKeys, RouteRequest, RoutingKey, check_block_keys
from kvforge.routing.router import (
    FOLLOW_MODES,
    ConversationRouter,
    CostGuard,
    ImbalanceGuard,
    NoServerAvailableError,
    RouterConfig,
    RouterStats,
)
from kvforge.routing.trie import BlockTrie, ServerPrefixIndex

__all__ = [
    "FOLLOW_MODES",
    "BlockKeys",
    "BlockTrie",
    "CacheAwareRouter",
    "ConversationRouter",
    "CostGuard",
    "ImbalanceGuard",
    "LeastLoadRouter",
    "LoadLedger",
    "NoServerAvailableError",
    "RequestInFlightError",
    "Reservation",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RouterStats",
    "RoutingKey",
    "ServerPrefixIndex",
    "check_block_keys",
]
