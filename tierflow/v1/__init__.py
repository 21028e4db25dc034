"""Generated from protos/ by tierflow.protogen."""
