"""One error type for everything posattn refuses: bad input, bad configuration, bad combination."""


class PositionError(ValueError):
    """Raised with a message that names the mechanism (or option) and the reason."""
