"""kvforge.routing: which server a request goes to (pure Python; consumes KV-cache block events as data)."""

from kvforge.routing.load import LoadLedger, RequestInFlightError, Reservation
from kvforge.routing.policies import CacheAwareRouter, LeastLoadRouter, RoundRobinRouter, Router
from kvforge.routing.request import RouteRequest, RoutingKey
from kvforge.routing.router import (
    FOLLOW_MODES,
    ConversationRouter,
    CostGuard,
    ImbalanceGuard,
    RouterConfig,
    RouterStats,
)
from kvforge.routing.trie import BlockTrie, ServerPrefixIndex

__all__ = [
    "FOLLOW_MODES",
    "BlockTrie",
    "CacheAwareRouter",
    "ConversationRouter",
    "CostGuard",
    "ImbalanceGuard",
    "LeastLoadRouter",
    "LoadLedger",
    "RequestInFlightError",
    "Reservation",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RouterStats",
    "RoutingKey",
    "ServerPrefixIndex",
]
