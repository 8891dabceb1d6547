"""A small multilingual sample written for llmpipe (en, zh, de, fr, ja, ru, es).

Paragraph-sized texts about everyday topics, then the same command's manual page in every language
(technical prose whose terms repeat, as real translated manuals do), so language ID, CJK-aware
filters, tokenizer training and per-language metrics all have real work on a machine with no network.
"""

SAMPLES: dict[str, list[str]] = {
    "en": [
        "The river behind the old mill freezes every winter. Children skate on it in the afternoon, and their parents watch from the bridge with cups of tea. By March the ice turns grey and thin, and the town council puts up signs asking everyone to stay off it.",
        "A good loaf of bread needs only flour, water, salt and time. The dough rests overnight in a cool kitchen, and the slow fermentation gives the crust its colour and the crumb its flavour. Bakers say that patience is the most important ingredient.",
        "Our library opened a small repair café on Saturdays. Volunteers fix lamps, radios and bicycles, and they teach visitors how to do it themselves. Last month they repaired more than forty items that would otherwise have been thrown away.",
        "Trains between the two cities run every half hour during the day. The journey takes about ninety minutes, and most passengers read, work on their laptops or simply look out of the window at the fields and the low hills.",
        "The museum's new exhibition explains how maps were made before satellites. Surveyors walked for months with chains and compasses, measuring angles from hilltops, and the results were surprisingly accurate for their time.",
        "Gardeners in the north plant potatoes in April and harvest them at the end of summer. The soil must be loose and well drained, and the plants need regular watering during dry weeks. A cool cellar keeps the harvest fresh until spring.",
        # en: a command's manual page (technical prose: terms repeat, as in real manuals)
        "By default, the copy command never overwrites a file that already exists in the target directory. When the --force option is given, existing files are replaced without a question. Use this option with care: a replaced file cannot be recovered, and the command does not keep a backup of it.",
        "Settings are read from the configuration file in the user's home directory. A value given on the command line always overrides the value in the configuration file. If the configuration file does not exist, the command uses the default values and prints no warning.",
        "The target is the directory where the copied files are written. If the target does not exist yet, it is created together with any missing parent directories. When more than one source file is given, the target must be a directory and not a single file.",
        "The command returns zero when every file was copied. It returns one when some files could not be copied, and two when the options on the command line are not valid. Error messages are written to standard error, so they do not mix with the normal output.",
        "With the --verbose option, the command prints the name of each file while it is being copied. The --quiet option suppresses all output except error messages. The two options cannot be used together; if both are given, the command stops with an error.",
        "The --exclude option takes a pattern and skips every file whose name matches it. The option can be given several times to exclude more than one pattern. Patterns are compared with the file name only, not with the full path of the file.",
        "When the server cannot be reached, the command waits for the time given by the --timeout option and then tries again. After three failed attempts it stops and reports an error. The default timeout is thirty seconds, which is enough for most local networks.",
    ],
    "zh": [
        "我们小区旁边新开了一家面包店，每天早上七点开门。店主是一对年轻夫妇，他们坚持用天然酵母发酵，面包的口感非常松软，很多邻居都成了回头客。",
        "春节前夕，火车站里挤满了回家的人。大家提着大包小包，脸上带着期待的笑容。虽然路途遥远，但是一想到能和家人团聚，所有的疲惫都不算什么。",
        "学习一门外语需要耐心和坚持。每天花半个小时阅读和听力练习，比周末突击几个小时效果更好。遇到不懂的词语，可以先猜测意思，再查词典确认。",
        "这座城市的公园里种满了桂花树。每到秋天，空气中弥漫着淡淡的花香，老人们在树下下棋聊天，孩子们在草地上追逐玩耍，一派热闹祥和的景象。",
        "图书馆最近推出了夜间开放服务，晚上十点才闭馆。许多上班族下班后来这里看书学习，安静的环境和舒适的座位让大家感到非常满意。",
        "爷爷年轻时是一名木匠，他做的桌椅结实耐用，几十年过去了依然完好。他常说，做事情要一丝不苟，手艺好不好，时间会给出答案。",
        # zh: a command's manual page (technical prose: terms repeat, as in real manuals)
        "默认情况下，复制命令不会覆盖目标目录中已经存在的文件。指定 --force 选项后，已有的文件会被直接替换，不再询问。请谨慎使用这个选项：被替换的文件无法恢复，命令也不会为它保留备份。",
        "设置从用户主目录下的配置文件中读取。在命令行中指定的值总是优先于配置文件中的值。如果配置文件不存在，命令会使用默认值，并且不会显示警告。",
        "目标是写入复制文件的目录。如果目标目录还不存在，命令会把它和缺少的上级目录一起创建。如果指定了多个源文件，目标必须是一个目录，而不能是单个文件。",
        "所有文件都复制成功时，命令返回零。部分文件无法复制时返回一，命令行选项无效时返回二。错误信息写入标准错误输出，因此不会和正常输出混在一起。",
        "使用 --verbose 选项时，命令会在复制每个文件时显示它的名称。--quiet 选项会屏蔽除错误信息以外的所有输出。这两个选项不能同时使用；如果同时指定，命令会报错并退出。",
        "要排除某些文件，可以用 --exclude 选项指定一个模式，名称与该模式匹配的文件都会被跳过。这个选项可以指定多次，用来排除多个模式。模式只与文件名比较，而不与文件的完整路径比较。",
        "无法连接服务器时，命令会等待 --timeout 选项指定的时间，然后重试。连续三次失败后，命令会停止并报告错误。默认的超时时间是三十秒，对大多数局域网来说已经足够。",
    ],
    "de": [
        "Am Wochenende fahren viele Familien mit dem Fahrrad an den See. Der Weg führt durch Felder und kleine Dörfer, und unterwegs gibt es mehrere Gasthäuser, in denen man eine Pause machen und etwas essen kann.",
        "Die Stadtbibliothek bietet seit diesem Herbst Kurse für ältere Menschen an, die lernen möchten, wie man ein Smartphone benutzt. Die Kurse sind kostenlos und finden jeden Dienstag am Vormittag statt.",
        "Im Frühling beginnt im Garten die meiste Arbeit. Die Beete werden umgegraben, Kompost wird verteilt und die ersten Samen kommen in die Erde. Wer geduldig ist, kann im Sommer eigenes Gemüse ernten.",
        "Der Zug nach München hatte heute Morgen eine Verspätung von zwanzig Minuten. Die Fahrgäste blieben jedoch ruhig, denn der Schaffner informierte sie freundlich über den Grund und die voraussichtliche Ankunftszeit.",
        "Unser Nachbar repariert in seiner Freizeit alte Uhren. In seiner Werkstatt stehen Dutzende Pendeluhren, und jede von ihnen hat eine eigene Geschichte, die er gerne seinen Besuchern erzählt.",
        # de: a command's manual page (technical prose: terms repeat, as in real manuals)
        "Standardmäßig überschreibt der Kopierbefehl keine Datei, die im Zielverzeichnis bereits vorhanden ist. Mit der Option --force werden vorhandene Dateien ohne Rückfrage ersetzt. Verwenden Sie diese Option mit Vorsicht: Eine ersetzte Datei lässt sich nicht wiederherstellen, und der Befehl legt keine Sicherungskopie an.",
        "Die Einstellungen werden aus der Konfigurationsdatei im Heimatverzeichnis des Benutzers gelesen. Ein Wert, der auf der Befehlszeile angegeben wird, hat immer Vorrang vor dem Wert in der Konfigurationsdatei. Wenn die Konfigurationsdatei nicht existiert, verwendet der Befehl die Standardwerte und gibt keine Warnung aus.",
        "Das Ziel ist das Verzeichnis, in das die kopierten Dateien geschrieben werden. Existiert das Ziel noch nicht, wird es zusammen mit allen fehlenden übergeordneten Verzeichnissen angelegt. Werden mehrere Quelldateien angegeben, muss das Ziel ein Verzeichnis sein und keine einzelne Datei.",
        "Der Befehl gibt null zurück, wenn alle Dateien kopiert wurden. Er gibt eins zurück, wenn einige Dateien nicht kopiert werden konnten, und zwei, wenn die Optionen auf der Befehlszeile ungültig sind. Fehlermeldungen werden in die Standardfehlerausgabe geschrieben, damit sie sich nicht mit der normalen Ausgabe vermischen.",
        "Mit der Option --verbose gibt der Befehl den Namen jeder Datei aus, während sie kopiert wird. Die Option --quiet unterdrückt alle Ausgaben außer Fehlermeldungen. Die beiden Optionen können nicht zusammen verwendet werden; werden beide angegeben, bricht der Befehl mit einem Fehler ab.",
        "Die Option --exclude erwartet ein Muster und überspringt jede Datei, deren Name darauf passt. Die Option kann mehrmals angegeben werden, um mehrere Muster auszuschließen. Muster werden nur mit dem Dateinamen verglichen, nicht mit dem vollständigen Pfad der Datei.",
        "Ist der Server nicht erreichbar, wartet der Befehl die mit der Option --timeout angegebene Zeit und versucht es dann erneut. Nach drei fehlgeschlagenen Versuchen bricht er ab und meldet einen Fehler. Die Standardzeitüberschreitung beträgt dreißig Sekunden, was für die meisten lokalen Netzwerke ausreicht.",
    ],
    "fr": [
        "Le marché du samedi matin attire beaucoup de monde dans le centre du village. On y trouve des fromages, des légumes de saison, du pain frais et des fleurs, et les marchands connaissent la plupart de leurs clients par leur prénom.",
        "Pendant les vacances d'été, la bibliothèque municipale organise des ateliers de lecture pour les enfants. Les bénévoles lisent des contes à voix haute, puis les enfants dessinent leurs personnages préférés.",
        "La randonnée jusqu'au sommet prend environ trois heures. Le sentier traverse une forêt de pins avant d'atteindre les prairies, d'où l'on peut voir le lac et les montagnes voisines par temps clair.",
        "Ma grand-mère préparait une tarte aux pommes chaque dimanche. Elle disait que le secret était une pâte faite à la main et des pommes un peu acides, coupées en tranches très fines.",
        "Le nouveau tramway relie désormais la gare au quartier de l'université. Les habitants apprécient ce moyen de transport rapide et silencieux, qui a aussi réduit la circulation dans les rues du centre.",
        # fr: a command's manual page (technical prose: terms repeat, as in real manuals)
        "Par défaut, la commande de copie n'écrase jamais un fichier qui existe déjà dans le répertoire cible. Avec l'option --force, les fichiers existants sont remplacés sans confirmation. Utilisez cette option avec prudence : un fichier remplacé ne peut pas être récupéré, et la commande n'en garde aucune sauvegarde.",
        "Les réglages sont lus dans le fichier de configuration situé dans le répertoire personnel de l'utilisateur. Une valeur donnée sur la ligne de commande remplace toujours celle du fichier de configuration. Si le fichier de configuration n'existe pas, la commande utilise les valeurs par défaut et n'affiche aucun avertissement.",
        "La cible est le répertoire dans lequel les fichiers copiés sont écrits. Si la cible n'existe pas encore, elle est créée avec tous les répertoires parents manquants. Lorsque plusieurs fichiers source sont indiqués, la cible doit être un répertoire et non un simple fichier.",
        "La commande renvoie zéro lorsque tous les fichiers ont été copiés. Elle renvoie un lorsque certains fichiers n'ont pas pu être copiés, et deux lorsque les options de la ligne de commande ne sont pas valides. Les messages d'erreur sont écrits sur la sortie d'erreur standard, afin de ne pas se mélanger à la sortie normale.",
        "Avec l'option --verbose, la commande affiche le nom de chaque fichier pendant sa copie. L'option --quiet supprime toute sortie sauf les messages d'erreur. Les deux options ne peuvent pas être utilisées ensemble ; si les deux sont indiquées, la commande s'arrête avec une erreur.",
        "L'option --exclude prend un motif et ignore chaque fichier dont le nom correspond à ce motif. L'option peut être donnée plusieurs fois pour exclure plusieurs motifs. Les motifs sont comparés au nom du fichier seulement, et non à son chemin complet.",
        "Lorsque le serveur est injoignable, la commande attend le délai donné par l'option --timeout, puis elle réessaie. Après trois tentatives échouées, elle s'arrête et signale une erreur. Le délai par défaut est de trente secondes, ce qui suffit pour la plupart des réseaux locaux.",
    ],
    "ja": [
        "駅前の小さな喫茶店は、朝七時から営業しています。店主が一杯ずつ丁寧にいれるコーヒーが評判で、出勤前の会社員や近所のお年寄りが毎日のように通っています。",
        "秋になると、山の木々が赤や黄色に色づきます。週末には多くの人がハイキングに出かけ、頂上からの美しい景色を楽しみながら、お弁当を食べて一日を過ごします。",
        "図書館では毎月、子ども向けの読み聞かせ会を開いています。ボランティアの方が絵本を読むと、子どもたちは目を輝かせて物語の世界に引き込まれていきます。",
        "祖父は若いころ漁師として働いていました。朝早く船を出し、夕方には魚をたくさん積んで港に戻ってきたそうです。今でも海の話をするときは、とても楽しそうな顔をします。",
        "新しい言語を学ぶときは、毎日少しずつ続けることが大切です。短い文章を声に出して読んだり、好きな歌の歌詞を覚えたりすると、自然に言葉が身についていきます。",
        # ja: a command's manual page (technical prose: terms repeat, as in real manuals)
        "デフォルトでは、copyコマンドはターゲットディレクトリにすでに存在するファイルを上書きしません。--forceオプションを指定すると、既存のファイルは確認なしで置き換えられます。置き換えられたファイルは元に戻せず、コマンドはそのバックアップも作成しないため、このオプションは注意して使用してください。",
        "設定は、ユーザーのホームディレクトリにある設定ファイルから読み込まれます。コマンドラインで指定した値は、常に設定ファイルの値より優先されます。設定ファイルが存在しない場合、コマンドはデフォルト値を使用し、警告は表示しません。",
        "ターゲットは、コピーしたファイルを書き込むディレクトリです。ターゲットがまだ存在しない場合は、足りない親ディレクトリと一緒に作成されます。ソースファイルを複数指定した場合、ターゲットは単一のファイルではなくディレクトリでなければなりません。",
        "すべてのファイルがコピーされた場合、コマンドは0を返します。一部のファイルをコピーできなかった場合は1を、コマンドラインのオプションが正しくない場合は2を返します。エラーメッセージは標準エラー出力に書き込まれるため、通常の出力とは混ざりません。",
        "コピーの経過を確認したい場合は、--verboseオプションを指定します。コマンドはコピー中の各ファイルの名前を表示します。--quietオプションは、エラーメッセージ以外のすべての出力を抑制します。この二つのオプションは同時に使用できません。両方を指定すると、コマンドはエラーで終了します。",
        "特定のファイルを除外するには、--excludeオプションにパターンを指定します。名前がそのパターンに一致するファイルはすべてスキップされます。複数のパターンを除外するには、このオプションを何回でも指定できます。パターンはファイルの名前だけと比較され、ファイルのフルパスとは比較されません。",
        "サーバーに接続できない場合、コマンドは--timeoutオプションで指定した時間だけ待ってから再試行します。三回続けて失敗すると、コマンドは処理を中止してエラーを報告します。デフォルトのタイムアウトは三十秒で、ほとんどのローカルネットワークではこれで十分です。",
    ],
    "ru": [
        "Зимой в нашем городе рано темнеет, но улицы украшают гирлянды и фонари. По вечерам люди гуляют по центральной площади, катаются на коньках и пьют горячий чай в маленьких кафе.",
        "Бабушка каждое лето варила варенье из малины и смородины. Банки стояли в погребе до самой зимы, и в холодные вечера вся семья собиралась за столом пить чай с вареньем.",
        "Новая линия метро соединила окраину города с центром. Теперь дорога до работы занимает у жителей района вдвое меньше времени, чем раньше, когда приходилось ездить на автобусе.",
        "В школьной библиотеке появился читальный зал с удобными креслами. Ученики приходят туда на переменах, чтобы почитать книги, подготовиться к урокам или просто отдохнуть в тишине.",
        "Осенью в лесу много грибов. Рано утром грибники отправляются в путь с корзинами и возвращаются домой к обеду, довольные своей добычей и свежим воздухом.",
        # ru: a command's manual page (technical prose: terms repeat, as in real manuals)
        "По умолчанию команда копирования не перезаписывает файлы, которые уже есть в целевом каталоге. С параметром --force существующие файлы заменяются без подтверждения. Используйте этот параметр осторожно: заменённый файл нельзя восстановить, а команда не сохраняет его резервную копию.",
        "Настройки читаются из файла конфигурации в домашнем каталоге пользователя. Значение, указанное в командной строке, всегда имеет приоритет над значением из файла конфигурации. Если файла конфигурации нет, команда использует значения по умолчанию и не выводит предупреждений.",
        "Цель — это каталог, в который записываются скопированные файлы. Если цели ещё нет, она создаётся вместе со всеми недостающими родительскими каталогами. Если указано несколько исходных файлов, целью должен быть каталог, а не отдельный файл.",
        "Команда возвращает ноль, если все файлы скопированы. Она возвращает единицу, если некоторые файлы скопировать не удалось, и двойку, если параметры командной строки неверны. Сообщения об ошибках выводятся в стандартный поток ошибок, поэтому они не смешиваются с обычным выводом.",
        "С параметром --verbose команда выводит имя каждого файла во время его копирования. Параметр --quiet подавляет весь вывод, кроме сообщений об ошибках. Эти два параметра нельзя использовать вместе: если указаны оба, команда завершается с ошибкой.",
        "Параметр --exclude принимает шаблон и пропускает каждый файл, имя которого ему соответствует. Параметр можно указать несколько раз, чтобы исключить несколько шаблонов. Шаблоны сравниваются только с именем файла, а не с полным путём к нему.",
        "Если сервер недоступен, команда ждёт время, заданное параметром --timeout, и затем повторяет попытку. После трёх неудачных попыток она останавливается и сообщает об ошибке. По умолчанию время ожидания составляет тридцать секунд, чего достаточно для большинства локальных сетей.",
    ],
    "es": [
        "Cada domingo, la plaza del pueblo se llena de puestos de comida, artesanía y música. Las familias pasean bajo los árboles, los niños juegan cerca de la fuente y los mayores charlan sentados en los bancos.",
        "La biblioteca del barrio ofrece clases gratuitas de informática para adultos. Muchos vecinos han aprendido a enviar correos, hacer videollamadas con sus nietos y buscar información en internet.",
        "El camino hacia el faro recorre la costa durante varios kilómetros. Desde allí se ven los acantilados, las pequeñas calas y, con un poco de suerte, algún delfín nadando cerca de la orilla.",
        "Mi abuelo cultivaba tomates, pimientos y calabacines en un huerto detrás de la casa. Decía que las verduras sabían mejor cuando uno mismo las había cuidado desde la semilla.",
        "El nuevo tren de cercanías ha reducido el tiempo de viaje entre la ciudad y los pueblos vecinos. Los estudiantes y trabajadores ya no dependen del coche para llegar a tiempo cada mañana.",
        # es: a command's manual page (technical prose: terms repeat, as in real manuals)
        "De forma predeterminada, el comando de copia nunca sobrescribe un archivo que ya existe en el directorio de destino. Con la opción --force, los archivos existentes se reemplazan sin pedir confirmación. Use esta opción con cuidado: un archivo reemplazado no se puede recuperar y el comando no guarda ninguna copia de seguridad.",
        "La configuración se lee del archivo de configuración que está en el directorio personal del usuario. Un valor indicado en la línea de comandos siempre tiene prioridad sobre el valor del archivo de configuración. Si el archivo de configuración no existe, el comando usa los valores predeterminados y no muestra ninguna advertencia.",
        "El destino es el directorio donde se escriben los archivos copiados. Si el destino todavía no existe, se crea junto con los directorios superiores que falten. Cuando se indica más de un archivo de origen, el destino debe ser un directorio y no un archivo individual.",
        "El comando devuelve cero cuando se han copiado todos los archivos. Devuelve uno cuando algunos archivos no se pudieron copiar y dos cuando las opciones de la línea de comandos no son válidas. Los mensajes de error se escriben en la salida de error estándar, para que no se mezclen con la salida normal.",
        "Con la opción --verbose, el comando muestra el nombre de cada archivo mientras lo copia. La opción --quiet suprime toda la salida excepto los mensajes de error. Las dos opciones no se pueden usar a la vez; si se indican ambas, el comando se detiene con un error.",
        "La opción --exclude recibe un patrón y omite todos los archivos cuyo nombre coincide con él. La opción se puede indicar varias veces para excluir más de un patrón. Los patrones se comparan solo con el nombre del archivo, no con su ruta completa.",
        "Cuando no se puede conectar con el servidor, el comando espera el tiempo indicado por la opción --timeout y luego lo vuelve a intentar. Después de tres intentos fallidos, se detiene e informa de un error. El tiempo de espera predeterminado es de treinta segundos, suficiente para la mayoría de las redes locales.",
    ],
}
