from .cli import run

if __name__ == "__main__":  # multiprocessing (spawn) re-imports __main__ in its helper processes
    run()
