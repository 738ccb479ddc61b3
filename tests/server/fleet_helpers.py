"""The console across replicas without Ray: two engine apps (each a replica) forward their step records to an
EventsHub that lives on its own event loop thread, as the hub actor does, and one server answers like Ray's proxy
with two applications: /v1/engine/events from the console's app (FleetEvents over the hub), everything else from
the first replica's app."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from dataclasses import dataclass, field

from server_helpers import ServerThread

from stepserve.server.ray.events_hub import EventsHub

EVENTS = "/v1/engine/events"


class InProcessActor:
    """`obj` on an event loop of its own; `handle.method.remote(*args)` gives an awaitable of the result in the
    caller's loop, as a Ray actor handle does (the arguments travel as they are: nothing is pickled), and a caller
    cancelled while it awaits gets an error, as from Ray."""

    def __init__(self, obj) -> None:
        self.obj = obj
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __getattr__(self, name: str):
        method = getattr(self.obj, name)
        loop = self.loop

        class Method:
            @staticmethod
            def remote(*args):
                return _like_ray(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_call(method, args), loop)))

        return Method

    def call(self, name: str, *args):
        """From a plain thread: the method's result."""
        return asyncio.run_coroutine_threadsafe(_call(getattr(self.obj, name), args), self.loop).result()

    def run(self, coroutine):
        """Start a coroutine on this loop (e.g. a replica's forwarder); its concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


class CallCancelled(Exception):
    """What a caller sees when its task is cancelled while it awaits an actor call: Ray raises its
    TaskCancelledError there, an Exception, not asyncio.CancelledError."""


async def _like_ray(future):
    try:
        return await future
    except asyncio.CancelledError:
        raise CallCancelled("the actor call was cancelled") from None


async def _call(method, args):
    result = method(*args)
    return await result if inspect.isawaitable(result) else result


def routed(events_app, default_app):
    """One ASGI app for both, as Ray's proxy routes two applications by their route prefixes (the lifespan is the
    default app's: the console's app has none)."""
    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == EVENTS:
            await events_app(scope, receive, send)
        else:
            await default_app(scope, receive, send)

    return app


@dataclass
class Fleet:
    hub: InProcessActor
    urls: dict[str, str]  # replica name -> where its own app answers
    front: ServerThread  # the console's app, and the first replica's for every other path, as through Ray's proxy
    console: object  # the FleetEvents behind /v1/engine/events
    apps: dict = field(default_factory=dict)  # replica name -> its app
    forwarders: list = field(default_factory=list)  # each replica's forward() (concurrent.futures.Future)

    @property
    def url(self) -> str:
        return self.front.url


@contextlib.contextmanager
def fleet(make_app, names=("replica-a", "replica-b"), api_key=None):
    """Replicas named `names`, each an app from `make_app(api_key)` over its own engine, forwarding to one hub;
    the console's stream over it. The first replica answers behind the front, the others on servers of their own
    (an engine answers on the loop that started it)."""
    from stepserve.server.console import events_app
    from stepserve.server.ray.fleet_events import FleetEvents, forward

    hub = InProcessActor(EventsHub())
    relay = InProcessActor(None)  # the replicas' forwarders run here, as on each replica's own loop under Ray
    apps = {name: make_app(api_key) for name in names}
    console = FleetEvents(hub, "console-test")
    try:
        with contextlib.ExitStack() as stack:
            front = stack.enter_context(ServerThread(routed(events_app(console, api_key, name="console"),
                                                            apps[names[0]])))
            urls = {names[0]: front.url}
            for name in names[1:]:
                urls[name] = stack.enter_context(ServerThread(apps[name])).url
            forwarders = [relay.run(forward(hub, app.state.server.events, name)) for name, app in apps.items()]
            reader = relay.run(console.run())  # as where the console's process starts: outside any request
            try:
                yield Fleet(hub, urls, front, console, apps, forwarders)
            finally:
                hub.call("close")
                for f in [*forwarders, reader]:
                    f.cancel()
    finally:
        relay.stop()
        hub.stop()
