"""What is wrong with one field of a request, named (e.g. "controls[1].scale"): the request layer reports it as a
ValidationError on that field."""


class FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
