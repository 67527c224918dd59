"""The Redis request bus between front ends and engine processes; the wire format is in `protocol`."""
