"""PCP, the Planetary Compute Protocol: peer-to-peer volunteer training of neural networks."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 1
