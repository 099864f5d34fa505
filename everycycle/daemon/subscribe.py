"""The socket's ``Subscribe``: the daemon's events (events.py) as ``Notice`` lines, until
the subscriber cancels it (``Cancel`` of its id: then ``Done``), falls too far behind
(``Error{Rejected}``: cut off), or goes away."""

from __future__ import annotations

import anyio

from ..errors import ErrorKind, InvalidRequestError
from ..protocol import Accepted, Done, Error, Notice, Subscribe
from .events import Bus, CutOff, Subscription, dumps, types_of
from .keys import Principal, may_act_for
from .outcome import Peer


class Subscribers:
    """The open subscriptions, by request id."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.open: dict[str, tuple[Peer, Subscription]] = {}

    async def serve(self, peer: Peer, req: Subscribe) -> None:
        """Tell ``peer`` each event until the subscription ends. Raises
        InvalidRequestError for an unknown type or an id already open."""
        rid = req.request_id
        types = types_of(req.types)
        if rid in self.open:
            raise InvalidRequestError(f"request id '{rid}' is already active")
        sub = self.bus.subscribe(types)
        self.open[rid] = (peer, sub)
        peer.emit(Accepted(rid, 0))
        try:
            while True:
                for event in await sub.next():
                    if isinstance(event, CutOff):
                        peer.emit(Error(rid, ErrorKind.REJECTED, event.message))
                        return
                    peer.emit(Notice(rid, event.TYPE, dumps(event)))
        except anyio.EndOfStream:  # cancelled, or its peer went away
            peer.emit(Done(rid))
        finally:
            self.open.pop(rid, None)
            sub.close()

    def cancel(self, rid: str, by: Principal) -> bool:
        """End subscription ``rid`` (its Done follows); False when there is none that
        ``by`` may end (its own, unless an admin's)."""
        found = self.open.get(rid)
        if found is None or not may_act_for(by, found[0].principal):
            return False
        found[1].close()
        return True

    def disconnect(self, peer: Peer) -> None:
        for owner, sub in list(self.open.values()):
            if owner is peer:
                sub.close()
