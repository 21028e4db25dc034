"""Generated from protos/ by launch.protogen."""
