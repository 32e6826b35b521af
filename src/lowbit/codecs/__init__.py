"""Codecs: pure tensor <-> payload transforms (no communication, no state). See :mod:`lowbit.codecs.base`."""

from lowbit.codecs.base import Codec, available_codecs, get_codec, parse_spec, register_codec

__all__ = ["Codec", "available_codecs", "get_codec", "parse_spec", "register_codec"]
