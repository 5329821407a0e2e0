"""quillctl: the admin CLI."""
import click


@click.group()
def main():
    """Administer a QuillCache node."""
