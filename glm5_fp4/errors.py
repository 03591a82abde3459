"""The one exception type users see for bad input: it names the culprit (file, field, shape)."""


class Glm5Fp4Error(Exception):
    """Bad input or an unsupported case, with a message meant for the user, not a traceback."""
