"""Typed application keys (aiohttp ``web.AppKey``)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from swarm_core.leader.app import LeaderConfig
    from swarm_core.leader.state import LeaderState

CONFIG_KEY: web.AppKey[LeaderConfig] = web.AppKey("config")
STATE_KEY: web.AppKey[LeaderState] = web.AppKey("state")
WEBSOCKETS_KEY: web.AppKey[weakref.WeakSet[web.WebSocketResponse]] = web.AppKey("websockets")
