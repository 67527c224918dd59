"""Celery's Redis transport, with one fix: a worker survives losing Redis while it holds unacknowledged
messages (a bulk job's task runs with ``acks_late``).

On a lost connection Celery (5.7) releases the connection's details (``collect``), closes the connection
again, and later acknowledges the tasks that were running then on their old channel. Both the close (which
restores the unacknowledged messages) and the acknowledgement build a new Redis client from the released
details, which raises ``AttributeError`` where only connection errors are expected, and the worker dies of it
("Unrecoverable error"). Nothing can be restored or acknowledged over a released connection anyway: the
messages are still in Redis's unacked set, which delivers them again after the visibility timeout (a bulk
task runs any number of times safely), or they were lost with Redis. So those are skipped; with the
connection open (a warm shutdown, a task's normal end) everything works as before.
"""

from __future__ import annotations

from kombu.transport import redis, virtual


class QoS(redis.QoS):
    def _released(self) -> bool:
        """Whether the channel's connection has been released (lost, and cleaned up by Celery)."""
        return self.channel.connection is None or self.channel.connection.client is None

    def restore_unacked(self, client=None) -> None:
        if client is None and self._released():
            self._delivered.clear()
            return
        super().restore_unacked(client)

    def ack(self, delivery_tag) -> None:
        if self._released():
            virtual.QoS.ack(self, delivery_tag)  # forgotten here; Redis's unacked set is not reachable
            return
        super().ack(delivery_tag)

    def reject(self, delivery_tag, requeue=False) -> None:
        if self._released():
            virtual.QoS.ack(self, delivery_tag)
            return
        super().reject(delivery_tag, requeue)


class Channel(redis.Channel):
    QoS = QoS


class Transport(redis.Transport):
    Channel = Channel
