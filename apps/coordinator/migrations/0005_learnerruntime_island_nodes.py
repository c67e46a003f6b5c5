from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('coordinator', '0004_coordinator_tick'),
    ]

    operations = [
        migrations.AddField(
            model_name='learnerruntime',
            name='island_nodes',
            field=models.JSONField(blank=True, default=list, help_text="worker names of the nodes an island over several nodes holds slots on, rank 0's first (set at dispatch: the nodes' reservation and where its ranks start)"),
        ),
    ]
