"""One router per endpoint group; ``serving.api.app`` includes them all."""
