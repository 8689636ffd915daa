from gaexp.app import cli

if __name__ == "__main__":
    cli()
