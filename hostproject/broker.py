"""Celery's Redis transport, with one fix: a worker survives losing Redis while it holds unacknowledged
messages (a bulk job's task runs with ``acks_late``; a countdown waits).

On a lost connection Celery (5.7) releases the connection's details (``collect``) and then closes it again;
that second close restores the unacknowledged messages through a new Redis client built from the released
details, which raises ``AttributeError`` where only connection errors are expected, and the worker dies of it
("Unrecoverable error"). Nothing can be restored over a lost connection anyway: the messages are still in
Redis's unacked set, which delivers them again after the visibility timeout (or they were lost with Redis),
so the restore is skipped then. A restore with the connection open (a warm shutdown) works as before.
"""

from __future__ import annotations

from kombu.transport import redis


class QoS(redis.QoS):
    def restore_unacked(self, client=None) -> None:
        if client is None and self.channel.connection.client is None:  # the connection was released
            self._delivered.clear()
            return
        super().restore_unacked(client)


class Channel(redis.Channel):
    QoS = QoS


class Transport(redis.Transport):
    Channel = Channel
