"""The parallelism library: no argparse, no global args; config objects and process groups."""
