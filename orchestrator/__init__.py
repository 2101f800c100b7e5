"""reval's laptop half: inventory -> transport -> sync -> launch -> follow -> pull -> compare. Never imports torch."""
__version__ = "0.1.0"
